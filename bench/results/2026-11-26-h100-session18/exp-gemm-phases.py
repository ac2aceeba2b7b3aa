"""The driver of exp-gemm-phases.log: the fused kernel whole (mode 0), with its GEMM-1 groups only
(1) and with its GEMM-2 groups only (2), beside the gated GEMMs launched alone. Needs the launch
built with exp-gemm-phases.patch (UNIEP_FUSED_EXPERIMENT); run from the repository root."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, "bench")
from bench_experts import routing  # noqa: E402
from uniep import gate  # noqa: E402
from uniep.gemm import pack_gate_up  # noqa: E402
from uniep.megakernel import expert_counts, moe_forward_local, trace_phases  # noqa: E402


def interleaved_synced_ms(fns: dict, warmup: int, iters: int) -> dict[str, float]:
    """What timed the log: rounds of one call of each function in turn, the host waiting for
    each call (CUDA events), medians."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def run(load: str, tokens: int, hidden: int, ffn: int, experts: int, top_k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(experts)
    bf16 = torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=bf16)
    w1 = torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda", dtype=bf16)
    w1p = pack_gate_up(w1 * hidden**-0.5)
    del w1
    w2 = torch.randn(experts, ffn, hidden, generator=gen, device="cuda", dtype=bf16) * ffn**-0.5
    idx, wts = routing(tokens, experts, top_k, seed=experts)
    idx, wts = idx.cuda(), wts.cuda()
    counts = expert_counts(idx, experts)
    dest, grow, _, _ = gate.sender_rows(idx, counts.view(1, experts), 0)
    offs = counts.cumsum(0).to(torch.int32)
    rows = torch.zeros(int(counts.sum()), hidden, dtype=bf16, device="cuda")
    used = dest >= 0
    rows[grow[used]] = x.unsqueeze(1).expand(-1, top_k, -1)[used]
    zeros = torch.zeros(rows.shape[0] // 128 + experts + 1, dtype=torch.int32, device="cuda")
    base = gate.tile_base(offs, rows.shape[0])
    act = rows.new_empty(rows.shape[0], ffn)
    y = rows.new_empty(rows.shape[0], hidden)

    def gated1() -> None:
        done = torch.zeros_like(zeros)
        gate.grouped_mm_gated(rows, w1p, offs, zeros, base, per_row=0, swiglu=True, done=done,
                              out=act)  # fmt: skip

    def plain1() -> None:
        torch.ops.uniep.grouped_mm_swiglu(rows, w1p, offs, "tile_m=128,tile_n=256,tile_k=64")

    def gated2() -> None:
        gate.grouped_mm_gated(act, w2, offs, zeros, base, per_row=0, out=y)

    def fused() -> None:
        moe_forward_local(x, idx, wts, w1p, w2, overlap="fused", check=False)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ms: dict[str, float] = {}
    for mode in ("0", "1", "2"):
        os.environ["UNIEP_FUSED_EXPERIMENT"] = mode
        fns = {"gated1": gated1, "plain1": plain1, "gated2": gated2, "fused": fused}
        for name, t in interleaved_synced_ms(fns, 3, 15).items():
            ms[name + mode] = round(t, 3)
        trace = torch.zeros(4 * sms, dtype=torch.int64, device="cuda")
        moe_forward_local(x, idx, wts, w1p, w2, overlap="fused", check=False, trace=trace)
        print(load, "mode", mode, {k: round(v) for k, v in trace_phases(trace).items()})
    print(load, ms, flush=True)


if __name__ == "__main__":
    run("dsv3", 4096, 7168, 2048, 32, 8)
    torch.cuda.empty_cache()
    run("mixtral", 8192, 4096, 14336, 2, 2)
