"""The driver of diag-fence.log and of the ncu-*.txt files: on the DeepSeek-V3 EP8-rank load at
world 1, the plain GEMM pair, the gated pair with gates open and with GEMM 2 waiting on GEMM 1's
done signal, the sequential composition and the fused kernel. ``time`` prints medians and the
fused kernel's phases; ``ncu`` makes one call of each for Nsight Compute. Run from the
repository root."""

import sys

import torch

sys.path.insert(0, "bench")
from bench_experts import routing
from common import median_time_ms
from uniep import gate
from uniep.gemm import pack_gate_up
from uniep.megakernel import expert_counts, moe_forward_local, trace_phases

which = sys.argv[1] if len(sys.argv) > 1 else "time"
tokens, hidden, ffn, experts, top_k = 4096, 7168, 2048, 32, 8
gen = torch.Generator(device="cuda").manual_seed(experts)
bf16 = torch.bfloat16
x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=bf16)
w1 = torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda", dtype=bf16) * hidden**-0.5
w2 = torch.randn(experts, ffn, hidden, generator=gen, device="cuda", dtype=bf16) * ffn**-0.5
idx, wts = routing(tokens, experts, top_k, seed=experts)
idx, wts = idx.cuda(), wts.cuda()
w1p = pack_gate_up(w1)
del w1
counts = expert_counts(idx, experts)
dest, grow, counter, _ = gate.sender_rows(idx, counts.view(1, experts), 0)
offs = counts.cumsum(0).to(torch.int32)
cap = tokens * top_k
base = gate.tile_base(offs, cap)
used = dest >= 0
rows = torch.zeros(cap, hidden, dtype=bf16, device="cuda")
rows[grow[used]] = x.unsqueeze(1).expand(-1, top_k, -1)[used]
act = torch.empty(cap, ffn, dtype=bf16, device="cuda")
y = torch.empty(cap, hidden, dtype=bf16, device="cuda")
zeros = torch.zeros(cap // 128 + experts + 1, dtype=torch.int32, device="cuda")


def gemm_only():
    a = torch.ops.uniep.grouped_mm_swiglu(rows, w1p, offs, "")
    return torch.ops.uniep.grouped_mm(a, w2, offs, "")


def gated_open():
    gate.grouped_mm_gated(rows, w1p, offs, zeros, base, per_row=0, swiglu=True, out=act)
    gate.grouped_mm_gated(act, w2, offs, zeros, base, per_row=0, out=y)


def gated_done():
    done = torch.zeros_like(zeros)
    gate.grouped_mm_gated(rows, w1p, offs, zeros, base, per_row=0, swiglu=True, done=done, out=act)
    gate.grouped_mm_gated(
        act, w2, offs, done, base, per_row=0, per_tile=gate.done_per_tile(2 * ffn), out=y
    )


def fused(comm=10000, skip=0, trace=None):
    return moe_forward_local(
        x,
        idx,
        wts,
        w1p,
        w2,
        overlap="fused",
        comm_sms=comm,
        skip_rounds=skip,
        check=False,
        trace=trace,
    )


def seq():
    return moe_forward_local(x, idx, wts, w1p, w2, check=False)


if which == "time":
    for name, fn in [
        ("gemm_only", gemm_only),
        ("gated_open", gated_open),
        ("gated_done", gated_done),
        ("sequential", seq),
        ("fused c10000", fused),
        ("fused c32", lambda: fused(32, -1)),
    ]:
        print(f"{name}: {median_time_ms(fn, 3, 20, cuda=True):.3f} ms", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for comm, skip in [(10000, 0), (32, -1)]:
        tr = torch.zeros(4 * sms, dtype=torch.int64, device="cuda")
        fused(comm, skip, tr)
        print(f"fused c{comm} phases", {k: round(v) for k, v in trace_phases(tr).items()})
else:  # one call of each, for ncu
    gemm_only()
    gated_done()
    fused()
    torch.cuda.synchronize()
