"""Times the grouped GEMM variants of this folder on the expert loads, prefill and decode.

    python run.py OUT_DIR build/libgv.so g0,g1,...,s0,d0 [LOAD,...]
    (build_run.sh builds and calls it; LOADS below, default the two of many small experts; the
    JSON goes to OUT_DIR/grouped_variants/grouped_variants.json, as the benchmarks' do)

Each load's experts (hidden, FFN, E; each token to its top-8 experts at random, as bench_experts
and bench_decode route them) give two products per batch: x w1[e] with w1 [E, hidden, 2 FFN],
then act w2[e] with w2 [E, FFN, hidden] (plain products, no SwiGLU). Prefill (4096 tokens) runs
the ``g`` variants at the scheduler's raster order along M and along N and at swizzle 1 and 2;
decode (a few tokens) the ``d`` variants and the ``s`` ones, which compute the swapped product
d^T = w^T x^T, at both raster orders. Beside them, on the same operands: the engine's grouped
GEMM (``torch.ops.uniep.grouped_mm``, its automatic choice) and ``torch._grouped_mm``. A point
counts only if its output has the engine's bits. Times: CUDA events around ``REPS`` calls of one
candidate, the candidates in turn, ``ROUNDS`` rounds, the median per candidate; and the floor of
a product that reads each weight it needs once: the touched experts' weight bytes at the HBM rate
measured in the same run (a streaming reduction over every weight).
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from common import topk_routing, write_result  # noqa: E402

LOADS = {  # hidden, ffn, experts, top-k, prefill tokens, decode batches (bench_experts' loads)
    "qwen3-30b-a3b": (2048, 768, 128, 8, 4096, (1, 4, 16)),
    "dsv3-256-experts": (7168, 2048, 256, 8, 4096, (1, 16)),
    # Larger experts, prefill only: whether a configuration that wins on small experts loses there.
    "dsv3-ep8-rank": (7168, 2048, 32, 8, 4096, ()),
    "mixtral-ep4-rank": (4096, 14336, 2, 2, 8192, ()),
}
DEFAULT_LOADS = ("qwen3-30b-a3b", "dsv3-256-experts")
RASTERS = {0: "m", 1: "n"}
ROUNDS, REPS = 7, 5


def time_rounds(cands: dict[str, Callable[[], object]]) -> dict[str, float]:
    for fn in cands.values():
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(ROUNDS):
        for key, fn in cands.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPS):
                fn()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / REPS)
    return {k: statistics.median(v) for k, v in times.items()}


def read_ms(*weights: torch.Tensor) -> float:
    """One streaming reduction over every weight: the HBM read rate's time."""
    return time_rounds({"read": lambda: sum(w.sum(dtype=torch.float32) for w in weights)})["read"]


class Library:
    """The variants' shared library: the problem arrays and one call per variant."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        ptr = ctypes.c_void_p
        for prep in (self.lib.gv_prepare, self.lib.gv_prepare_swapped):
            prep.restype = ptr
            prep.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ptr, ptr, ptr]
            prep.argtypes += [ctypes.c_int, ctypes.c_int]
        self.lib.gv_free.argtypes = [ptr]
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def sweep(
        self,
        row: dict,
        a: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        names: list[str],
        swizzles: tuple[int, ...],
    ) -> None:
        """Fills row with the engine's, torch's and every valid point's median times."""
        experts, k, n = w.shape
        offs_c = (ctypes.c_int * experts)(*offs.tolist())
        offs_dev = offs.cuda()
        ref = torch.ops.uniep.grouped_mm(a, w, offs_dev)
        d = torch.empty_like(ref)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        handles = {}
        for swapped in {name.startswith("s") for name in names}:
            prep = self.lib.gv_prepare_swapped if swapped else self.lib.gv_prepare
            handles[swapped] = prep(experts, offs_c, a.data_ptr(), w.data_ptr(), d.data_ptr(), k, n)
            if not handles[swapped]:
                raise RuntimeError("gv_prepare failed")
        cands: dict[str, Callable[[], object]] = {
            "engine": lambda: torch.ops.uniep.grouped_mm(a, w, offs_dev),
        }
        try:  # the peer may refuse a layout (e.g. groups of a few rows): then no peer time
            torch._grouped_mm(a, w, offs=offs_dev)
            torch.cuda.synchronize()
            cands["torch"] = lambda: torch._grouped_mm(a, w, offs=offs_dev)
        except RuntimeError as exc:
            row["torch_error"] = str(exc).splitlines()[0][:200]
        row["points"] = {}
        for name in names:
            fn = getattr(self.lib, name)
            handle = ctypes.c_void_p(handles[name.startswith("s")])
            for r, rname in RASTERS.items():
                for s in swizzles:
                    args = (
                        handle,
                        self.sms,
                        r,
                        s,
                        ctypes.c_void_p(self.ws.data_ptr()),
                        ctypes.c_size_t(self.ws.numel()),
                        stream,
                    )
                    key = f"{name}_{rname}{s}"
                    d.zero_()
                    rc = fn(*args)
                    torch.cuda.synchronize()
                    if rc != 0:
                        row["points"][key] = f"rc{rc}"
                    elif not torch.equal(d, ref):
                        row["points"][key] = "bits differ"
                    else:
                        cands[key] = lambda f=fn, x=args: f(*x)
        t = time_rounds(cands)
        for handle in handles.values():
            self.lib.gv_free(ctypes.c_void_p(handle))
        row["engine_ms"], row["torch_ms"] = t.pop("engine"), t.pop("torch", None)
        row["points"].update(t)
        best: dict[str, list] = {}
        for key, ms in t.items():
            v = key.split("_")[0]
            if v not in best or ms < best[v][0]:
                best[v] = [ms, key, ms / row["engine_ms"]]
        row["best_over_engine"] = {v: round(b[2], 4) for v, b in best.items()}
        if best:
            row["best_ms"], row["best_point"] = min(b[:2] for b in best.values())
        failed = "".join(f" {p}={v}" for p, v in row["points"].items() if isinstance(v, str))
        print(
            f"{row['load']} {row['tokens']} tokens {row['gemm']} (k {k}, n {n}): engine "
            f"{row['engine_ms'] * 1e3:.1f} us ({row['engine_ms'] / row['floor_ms']:.2f}x the "
            f"read), torch "
            + (f"{row['torch_ms'] / row['engine_ms']:.3f}x; " if row["torch_ms"] else "-; ")
            + " ".join(f"{key}:{ratio:.3f}" for _, key, ratio in sorted(best.values()))
            + failed,
            flush=True,
        )


def main(out_dir: str, lib_path: str, names: list[str], loads: list[str]) -> None:
    import uniep  # noqa: F401  (registers torch.ops.uniep)

    lib = Library(lib_path)
    rows: list[dict] = []
    # Each variant's pipeline stages * 10^6 + shared memory in KiB, kept in every row.
    info = {n: getattr(lib.lib, n + "_info")() for n in names}
    print("stages * 10^6 + smem KiB:", info, flush=True)
    prefill = [n for n in names if n.startswith("g")]
    decode = [n for n in names if n.startswith(("d", "s"))]
    bf16 = torch.bfloat16
    for load in loads:
        hidden, ffn, experts, top_k, prefill_tokens, batches = LOADS[load]
        gen = torch.Generator(device="cuda").manual_seed(experts)
        w1 = torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda", dtype=bf16)
        w1.mul_(hidden**-0.5)
        w2 = torch.randn(experts, ffn, hidden, generator=gen, device="cuda", dtype=bf16)
        w2.mul_(ffn**-0.5)
        read_gbs = (w1.numel() + w2.numel()) * 2 / read_ms(w1, w2) / 1e6
        print(f"{load}: HBM read {read_gbs:.0f} GB/s", flush=True)
        cases = [(prefill_tokens, prefill, (1, 2))] if prefill else []
        cases += [(t, decode, (1,)) for t in batches] if decode else []
        for tokens, variants, swizzles in cases:
            idx, _ = topk_routing(tokens, experts, top_k, seed=tokens)
            counts = torch.bincount(idx.flatten(), minlength=experts)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            rows, touched = int(offs[-1]), int((counts > 0).sum())
            x = torch.randn(rows, hidden, generator=gen, device="cuda", dtype=bf16)
            act = torch.randn(rows, ffn, generator=gen, device="cuda", dtype=bf16)
            for gemm, a, w in (("up", x, w1), ("down", act, w2)):
                per_expert = w.shape[1] * w.shape[2] * 2
                row: dict = {
                    "sms": lib.sms,
                    "stages_smem": info,
                    "load": load,
                    "tokens": tokens,
                    "gemm": gemm,
                    "k": w.shape[1],
                    "n": w.shape[2],
                    "experts": experts,
                    "touched": touched,
                    "rows": rows,
                    "read_gbs": read_gbs,
                    "floor_ms": touched * per_expert / read_gbs / 1e6,
                }
                lib.sweep(row, a, w, offs, variants, swizzles)
                rows.append(row)
            del x, act
        del w1, w2
        torch.cuda.empty_cache()
    print("wrote", write_result("grouped_variants", rows, out_dir), flush=True)


if __name__ == "__main__":
    loads = sys.argv[4].split(",") if len(sys.argv) > 4 else list(DEFAULT_LOADS)
    unknown = [name for name in loads if name not in LOADS]
    if unknown:
        sys.exit(f"unknown loads {unknown}; known: {sorted(LOADS)}")
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), loads)
