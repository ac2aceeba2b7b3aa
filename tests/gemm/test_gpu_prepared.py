"""uniep.moe.prepared on one GPU (marker `gpu`): moe_forward_prepared with packed bf16 experts gives
moe_forward's own bits (the SwiGLU epilogue uses the one-pass SwiGLU's formula on the same GEMM
bits) on the separate launches (the default) and on the MegaKernel (overlap=fused), also with a few
CTAs sending first, with the launch keys of the tuning string (tile height, skip rounds) and the
point cached by uniep.tune for an empty string, its errors raised later without a wait, and after a
larger batch grew the fused runtime; with fp8 experts it stays within the fp8 error of the bf16
layer and close to a float64 layer on the same dequantized operands, and moe_forward with
dispatch=fp8 gives its bits on the e4m3 copy of the weights it keeps (a new one after an in-place
update), within tolerance of the CPU executor. World 1 (NCCL), and two and four ranks sharing the
GPU (gloo)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

T, H, FFN, E_LOCAL, K = 96, 256, 256, 3, 3


def _worker(rank: int, world: int) -> dict[str, float]:
    import uniep
    from uniep.gemm import (
        dequantize_expert_weights,
        dequantize_rows,
        quantize_expert_weights,
        quantize_rows,
    )
    from uniep.moe.megakernel import launch as megakernel
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts
    from uniep.reference import moe_reference
    from uniep.tuning import tuner as tune

    dev = torch.device("cuda", torch.cuda.current_device())
    experts = E_LOCAL * world
    gen = torch.Generator().manual_seed(7)
    w1_all = torch.randn(experts, H, 2 * FFN, generator=gen) * H**-0.5
    w2_all = torch.randn(experts, FFN, H, generator=gen) * FFN**-0.5
    gen.manual_seed(100 + rank)
    x = torch.randn(T - 7 * rank, H, generator=gen).bfloat16()
    idx = torch.rand(x.shape[0], experts, generator=gen).argsort(dim=1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(x.shape[0], K, generator=gen), dim=1)
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    w1, w2 = w1_all[mine].bfloat16(), w2_all[mine].bfloat16()
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    base = uniep.moe_forward(xd, idxd, wd, w1.to(dev), w2.to(dev))
    out: dict[str, float] = {}

    packed = prepare_experts(w1.to(dev), w2.to(dev), "bf16_packed")
    # Count the size agreements (host round trips) the prepared MegaKernel path makes.
    agreements: list[int] = []
    real_ensure = megakernel.ensure_fused_ep

    def counting_ensure(*args: object, **kwargs: object) -> None:
        agreements.append(1)
        real_ensure(*args, **kwargs)

    megakernel.ensure_fused_ep = counting_ensure
    # The default point runs separate launches; overlap=fused named runs the MegaKernel (world 1:
    # one launch; ranks: the fused runtime, created here). Both give moe_forward's bits.
    got = moe_forward_prepared(xd, idxd, wd, packed)
    out["packed_equal"] = float(torch.equal(got, base))
    fused = moe_forward_prepared(xd, idxd, wd, packed, tuning="overlap=fused")
    out["fused_equal"] = float(torch.equal(fused, base))
    few = moe_forward_prepared(xd, idxd, wd, packed, tuning="overlap=fused,sms=8/0")
    out["few_senders_equal"] = float(torch.equal(few, base))  # 8 CTAs send first
    # The launch keys of the tuning string reach the kernel: the other tile height (across
    # ranks the runtime is created again with it) and rounds of tiles taken before the senders.
    auto_tile = megakernel.fused_tile_m(x.shape[0] * K * world, experts)
    other = 128 if auto_tile == 64 else 64
    keys = f"overlap=fused,sms=16,skip_rounds=2,tile_m={other}"
    calls: list[dict] = []
    real_local = megakernel.moe_forward_local

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return real_local(*args, **kwargs)

    megakernel.moe_forward_local = spy
    try:
        retiled = moe_forward_prepared(xd, idxd, wd, packed, tuning=keys)
        # An empty tuning string takes the point uniep.tune cached for this shape and format.
        cache = os.path.join(tempfile.mkdtemp(), "tune.json")
        os.environ["UNIEP_TUNE_CACHE"] = cache
        tune.store(
            keys, tokens=x.shape[0], hidden=H, ffn=FFN, experts=experts, top_k=K,
            dtype=torch.bfloat16, world_size=world, device=dev, weights="bf16_packed",
        )  # fmt: skip
        cached = moe_forward_prepared(xd, idxd, wd, packed)
        del os.environ["UNIEP_TUNE_CACHE"]
    finally:
        megakernel.moe_forward_local = real_local
    if world == 1:
        # The MegaKernel's errors are checked without waiting: a bad expert id is raised by
        # check_errors(), or by the next call once the stream has passed the failed one.
        bad = idxd.clone()
        bad[5, 1] = experts + 3
        raised = []
        for surface in ("check_errors", "next call"):
            moe_forward_prepared(xd, bad, wd, packed, tuning="overlap=fused")
            try:
                if surface == "check_errors":
                    megakernel.check_errors()
                else:
                    torch.cuda.synchronize()
                    moe_forward_prepared(xd, idxd, wd, packed, tuning="overlap=fused")
            except ValueError as e:
                # The plan apart, or made in the fused launch (decode batches).
                raised.append("moe_forward_local (plan" in str(e))
        megakernel.check_errors()  # nothing left pending
        after = moe_forward_prepared(xd, idxd, wd, packed, tuning="overlap=fused")
        out["deferred_raised"] = float(raised == [True, True] and torch.equal(after, base))
    out["retiled_equal"] = float(torch.equal(retiled, base))
    out["cached_equal"] = float(torch.equal(cached, base))
    if world == 1:
        want = {"comm_sms": 16, "skip_rounds": 2, "tile_m": other}
        seen = [{key: c.get(key) for key in want} for c in calls]
        out["keys_reached"] = float(seen == [want, want])
    else:
        from uniep import _C, distributed

        cfg = _C.fused_ep_config(distributed.group_name(None))
        out["keys_reached"] = float(not calls and cfg["tile_m"] == other)
    megakernel.ensure_fused_ep = real_ensure
    # Across ranks: one agreement to create the runtime and one to re-tile it, none for the
    # calls that fit it.
    out["agreements"] = float(len(agreements))
    # A larger batch on one rank: ensure_fused_ep on every rank grows the runtime for it first
    # (the prepared path agrees sizes only when the runtime lacks room on this rank).
    big = 300 if rank == 0 else x.shape[0]
    if world > 1:
        megakernel.ensure_fused_ep(None, tokens=big, hidden=H, ffn=FFN, top_k=K,
                                   num_experts=experts)  # fmt: skip
    gen.manual_seed(200 + rank)
    xb = torch.randn(big, H, generator=gen).bfloat16().to(dev)
    idxb = torch.rand(big, experts, generator=gen).argsort(dim=1)[:, :K].contiguous().to(dev)
    wb = torch.softmax(torch.randn(big, K, generator=gen), dim=1).to(dev)
    got_big = moe_forward_prepared(xb, idxb, wb, packed, tuning="overlap=fused")
    base_big = uniep.moe_forward(xb, idxb, wb, w1.to(dev), w2.to(dev))
    out["grown_equal"] = float(torch.equal(got_big, base_big))
    if world > 1:
        from uniep import _C, distributed

        cfg = _C.fused_ep_config(distributed.group_name(None))
        out["fused_max_tokens"] = float(cfg["max_tokens"])

    fp8 = prepare_experts(w1.to(dev), w2.to(dev), "fp8")
    got8 = moe_forward_prepared(xd, idxd, wd, fp8, tuning="dispatch=fp8").float()
    out["fp8_vs_bf16"] = float((got8 - base.float()).norm() / base.float().norm())
    # The reference the GPU path approximates: float64 over the dequantized fp8 operands (the
    # rows' 1x128 and the weights' 128x128 blocks), all experts on this process (no collective:
    # the CPU executor would need a gloo group, and the world-1 run has an NCCL one).
    xr = dequantize_rows(*quantize_rows(x.float()))
    w1r = dequantize_expert_weights(*quantize_expert_weights(w1_all.bfloat16()))
    w2r = dequantize_expert_weights(*quantize_expert_weights(w2_all.bfloat16()))
    ref8 = moe_reference(xr, idx, w, w1r, w2r)
    out["fp8_vs_ref"] = float((got8.cpu().double() - ref8).norm() / ref8.norm())

    # moe_forward with dispatch=fp8 runs the same fp8 experts on an e4m3 copy of w1 and w2 it
    # keeps: the prepared path's bits, the kept copy's too, and a new one after an update.
    w1d, w2d = w1.to(dev), w2.to(dev)
    plain8 = uniep.moe_forward(xd, idxd, wd, w1d, w2d, tuning="dispatch=fp8")
    out["plain_fp8_equal"] = float(torch.equal(plain8.float(), got8))
    again = uniep.moe_forward(xd, idxd, wd, w1d, w2d, tuning="dispatch=fp8")
    out["plain_fp8_again"] = float(torch.equal(again, plain8))
    with torch.no_grad():
        w1d.mul_(2)
    doubled = uniep.moe_forward(xd, idxd, wd, w1d, w2d, tuning="dispatch=fp8")
    fresh = moe_forward_prepared(
        xd, idxd, wd, prepare_experts(w1d, w2d, "fp8"), tuning="dispatch=fp8"
    )
    out["updated_equal"] = float(torch.equal(doubled, fresh) and not torch.equal(doubled, plain8))
    # The tile keys pick among the fp8 GEMM's configurations: the same bits; a bf16-only tile
    # is refused naming them.
    tiled = uniep.moe_forward(xd, idxd, wd, w1d, w2d, tuning="dispatch=fp8,tile_m=64")
    out["fp8_tile_equal"] = float(torch.equal(tiled, doubled))
    try:
        uniep.moe_forward(xd, idxd, wd, w1d, w2d, tuning="dispatch=fp8,tile_n=256")
        out["fp8_bad_tile_named"] = 0.0
    except ValueError as e:
        out["fp8_bad_tile_named"] = float("tile_m=128,tile_n=128,tile_k=128" in str(e))
    if world > 1:
        # The CPU executor over the gloo group, the reference of every GPU path.
        from uniep.distributed import group_name

        cpu8 = torch.ops.uniep.moe_forward(x, idx, w, w1, w2, group_name(None), "dispatch=fp8")
        out["fp8_vs_cpu"] = float((plain8.cpu().float() - cpu8.float()).norm() / cpu8.norm())
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_prepared_experts(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from uniep.distributed import run_local_ranks

    if world > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    backend = "nccl" if world == 1 else "gloo"
    for report in run_local_ranks(_worker, world, backend=backend, timeout_s=300):
        assert report["packed_equal"] == 1.0, report
        assert report["fused_equal"] == 1.0, report
        assert report["few_senders_equal"] == 1.0, report
        assert report["retiled_equal"] == report["cached_equal"] == 1.0, report
        assert report["keys_reached"] == 1.0, report
        if world == 1:
            assert report["deferred_raised"] == 1.0, report
        assert report["grown_equal"] == 1.0, report
        if world > 1:  # 256 held the first batches; rank 0's 300 tokens grew it to 512
            assert report["fused_max_tokens"] == 512, report
        assert report["agreements"] == (0.0 if world == 1 else 2.0), report
        # The GPU path also quantizes the activation for the second GEMM (the float64 reference
        # keeps it exact): within the fp8 error of random operands over two GEMMs.
        assert report["fp8_vs_bf16"] <= 1e-1, report
        assert report["fp8_vs_ref"] <= 6e-2, report
        assert report["plain_fp8_equal"] == report["plain_fp8_again"] == 1.0, report
        assert report["updated_equal"] == 1.0, report
        assert report["fp8_tile_equal"] == report["fp8_bad_tile_named"] == 1.0, report
        if world > 1:  # a GEMM's one-ulp difference in h can move the activation's e4m3 step
            assert report["fp8_vs_cpu"] <= 2e-2, report


def test_decode_steps_replay_in_a_cuda_graph() -> None:
    """moe_forward_prepared with packed experts and no tuning on decode batches: the MegaKernel
    by default (uniep.moe.megakernel.launch.fused_by_default), captured once per batch size after
    a warm-up call and replayed on new tokens and routing in the same buffers, each replay with
    the eager call's bits; a bad expert id in a replay is raised by check_errors(), naming the
    graph, and the next replays are clean again."""
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel
    from uniep.moe.megakernel.launch import moe_forward_local
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts

    dev = torch.device("cuda", torch.cuda.current_device())
    experts, hidden, ffn, top_k = 64, 256, 128, 8
    gen = torch.Generator(device=dev).manual_seed(3)
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device=dev) / 16).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device=dev) / 11).bfloat16()
    packed = prepare_experts(w1, w2, "bf16_packed")

    def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(tokens, hidden, generator=gen, device=dev).bfloat16()
        scores = torch.rand(tokens, experts, generator=gen, device=dev)
        idx = scores.topk(top_k, dim=1).indices
        return x, idx, torch.rand(tokens, top_k, generator=gen, device=dev)

    calls: list[dict] = []
    real_local = megakernel.moe_forward_local

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return real_local(*args, **kwargs)

    stream = torch.cuda.Stream()
    for tokens in (1, 16, 64):
        assert megakernel.fused_by_default(tokens * top_k, experts, 1)
        x, idx, w = routing(tokens)
        megakernel.moe_forward_local = spy
        try:
            with torch.cuda.stream(stream):  # the warm-up, eagerly
                eager = moe_forward_prepared(x, idx, w, packed)
        finally:
            megakernel.moe_forward_local = real_local
        assert calls and calls[-1]["overlap"] == "fused", "the default did not take the MegaKernel"
        ref = moe_forward_local(x, idx, w, pack_gate_up(w1), w2)
        assert torch.equal(eager.cpu(), ref.cpu())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = moe_forward_prepared(x, idx, w, packed)
        graph.replay()
        assert torch.equal(out, eager), f"{tokens} tokens: the replay differs from the eager call"
        for _ in range(2):
            x2, idx2, w2_ = routing(tokens)
            x.copy_(x2)
            idx.copy_(idx2)
            w.copy_(w2_)
            graph.replay()
            want = moe_forward_local(x, idx, w, pack_gate_up(w1), w2)
            assert torch.equal(out, want), f"{tokens} tokens: a replay on new routing differs"
        megakernel.check_errors()
        # A bad expert id in a replay: kept on the device, raised by check_errors() once.
        idx[0, 1] = experts + 5
        graph.replay()
        with pytest.raises(ValueError, match=r"in a CUDA graph.*token 0, k 1"):
            megakernel.check_errors()
        idx[0, 1] = 0 if idx[0, 0] != 0 else 1
        graph.replay()
        megakernel.check_errors()


def _fp8_graph_worker(rank: int, world: int) -> dict[str, object]:
    """fp8 experts at world 1 (uniep.moe.fp8_local): the dispatch path's bits eagerly, and a CUDA
    graph of the call replayed on new tokens and routing; checks as strings, so that the report
    says which failed."""
    import uniep
    from uniep.distributed import group_name
    from uniep.moe import fp8_local, prepared
    from uniep.moe.megakernel import launch as megakernel
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts

    dev = torch.device("cuda", torch.cuda.current_device())
    experts, hidden, ffn, top_k = 32, 256, 256, 4
    gen = torch.Generator(device=dev).manual_seed(5)
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device=dev) / 16).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device=dev) / 16).bfloat16()
    fp8 = prepare_experts(w1, w2, "fp8")
    tuning = "dispatch=fp8"
    # The dispatch path (the reference) needs a runtime that holds the largest batch.
    uniep.moe.ep.init_runtime(None, max_tokens=700, hidden=hidden, top_k=top_k, num_experts=experts)

    def routing(tokens: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(tokens, hidden, generator=gen, device=dev).bfloat16()
        scores = torch.rand(tokens, experts, generator=gen, device=dev)
        if skew:  # every token to expert 3, the others among the first 8: 24 experts empty
            scores[:, 3] = 2.0
            scores[:, 8:] = -1.0
        idx = scores.topk(top_k, dim=1).indices
        idx[torch.rand(tokens, top_k, generator=gen, device=dev) < 0.15] = -1  # unused entries
        return x, idx, torch.rand(tokens, top_k, generator=gen, device=dev)

    def dispatch_path(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return prepared._forward_cuda(x, idx, w, fp8, group_name(None), 1, tuning)

    failed: list[str] = []
    stream = torch.cuda.Stream()
    for tokens, skew in [(1, False), (16, True), (64, False), (300, False), (700, True)]:
        x, idx, w = routing(tokens, skew)
        with torch.cuda.stream(stream):  # the warm-up, eagerly (the dispatch at these sizes)
            eager = moe_forward_prepared(x, idx, w, fp8, tuning=tuning)
        local = fp8_local.moe_forward_fp8_local(x, idx, w, fp8, tuning)  # the no-sync path
        torch.cuda.synchronize()
        if not torch.equal(local, dispatch_path(x, idx, w)) or not torch.equal(local, eager):
            failed.append(f"{tokens} tokens: the no-sync path differs from the dispatch path")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = moe_forward_prepared(x, idx, w, fp8, tuning=tuning)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager):
            failed.append(f"{tokens} tokens: the replay differs from the eager call")
        for _ in range(2):
            x2, idx2, w2_ = routing(tokens, not skew)
            x.copy_(x2)
            idx.copy_(idx2)
            w.copy_(w2_)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, dispatch_path(x, idx, w)):
                failed.append(f"{tokens} tokens: a replay on new routing differs")
        megakernel.check_errors()
        # A bad expert id in a replay: kept on the device, raised by check_errors() once.
        idx[0, top_k - 1] = experts + 2
        graph.replay()
        try:
            megakernel.check_errors()
            failed.append(f"{tokens} tokens: a bad id in a replay was not raised")
        except ValueError as e:
            if "in a CUDA graph" not in str(e) or f"token 0, k {top_k - 1}" not in str(e):
                failed.append(f"{tokens} tokens: the error does not name the entry: {e}")
        idx[0, top_k - 1] = -1
        graph.replay()
        megakernel.check_errors()
    # Eagerly (a batch large enough for the no-sync path), a bad id is raised by check_errors()
    # or the next call, naming the plan.
    x, idx, w = routing(fp8_local.EAGER_MIN_ROWS // top_k, False)
    idx[2, 1] = experts
    moe_forward_prepared(x, idx, w, fp8, tuning=tuning)
    try:
        megakernel.check_errors()
        failed.append("eager: a bad id was not raised")
    except ValueError as e:
        if "fp8 plan" not in str(e) or "token 2, k 1" not in str(e):
            failed.append(f"eager: the error does not name the plan and entry: {e}")
    empty = moe_forward_prepared(x[:0], idx[:0], w[:0], fp8, tuning=tuning)
    if empty.shape != (0, hidden):
        failed.append(f"no tokens: shape {tuple(empty.shape)}")
    return {"failed": failed}


def test_fp8_decode_replays_in_a_cuda_graph() -> None:
    """fp8 experts at world 1 without a host sync (uniep.moe.fp8_local): the dispatch path's bits
    (one token to 700, skewed routing with empty experts, unused entries); moe_forward_prepared
    captured once per batch size after an eager warm-up (which takes the dispatch at these sizes)
    replays on new tokens and routing with those bits; a bad expert id is kept on the device and
    raised by check_errors(), naming the entry, in a replay and eagerly."""
    from uniep.distributed import run_local_ranks

    (report,) = run_local_ranks(_fp8_graph_worker, 1, backend="nccl", timeout_s=300)
    assert report["failed"] == [], report
