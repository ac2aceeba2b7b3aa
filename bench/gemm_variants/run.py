"""Times the GEMM variants of this folder against torch.mm (cuBLAS) on the TP=2 chunk shapes.

    python run.py OUT.json build/libv.so v0,v4,v5   (build_run.sh builds the library and calls it)

Each variant runs at scheduler swizzle 1, 2 and 4; a result counts only if it matches torch.mm
(max error <= 1% of the largest |output|). Times are medians of CUDA events after warm-up, the
variants of one shape right after its cuBLAS time.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
from collections.abc import Callable

import torch

SHAPES = [
    (4096, 8192, 7168),
    (2048, 8192, 7168),
    (1024, 8192, 7168),
    (2048, 8192, 2048),
    (1024, 8192, 2048),
    (512, 8192, 2048),
    (8192, 4096, 3584),
    (4096, 4096, 3584),
    (2048, 4096, 3584),
    (8192, 8192, 8192),
]
SWIZZLES = (1, 2, 4)


def median_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 60) -> float:
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main(out_path: str, lib_path: str, names: list[str]) -> None:
    lib = ctypes.CDLL(lib_path)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    out: dict = {"device": torch.cuda.get_device_name(), "sms": sms, "rows": []}
    out["info"] = {n: getattr(lib, n + "_info")() for n in names}
    print(out["info"], flush=True)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda").bfloat16()
        b = (torch.randn(k, n, device="cuda") * k**-0.5).bfloat16()
        ref = a @ b
        d = torch.empty_like(ref)
        cublas = median_ms(lambda a=a, b=b, d=d: torch.mm(a, b, out=d))
        row: dict = {"m": m, "k": k, "n": n, "cublas": cublas}
        for name in names:
            fn = getattr(lib, name)
            for swz in SWIZZLES:
                args = (
                    ctypes.c_void_p(a.data_ptr()),
                    ctypes.c_void_p(b.data_ptr()),
                    ctypes.c_void_p(d.data_ptr()),
                    m,
                    n,
                    k,
                    sms,
                    swz,
                    ctypes.c_void_p(ws.data_ptr()),
                    ctypes.c_size_t(ws.numel()),
                    stream,
                )
                rc = fn(*args)
                torch.cuda.synchronize()
                key = f"{name}_s{swz}"
                if rc != 0:
                    row[key] = f"rc{rc}"
                    continue
                err = ((d.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row[key] = median_ms(lambda f=fn, x=args: f(*x)) if err < 1e-2 else f"err{err:.3g}"
        best = {}
        for name in names:
            times = [row[f"{name}_s{s}"] for s in SWIZZLES]
            ok = [t for t in times if isinstance(t, float)]
            best[name] = min(ok) / row["cublas"] if ok else float("nan")
        row["best_over_cublas"] = best
        ratios = " ".join(f"{v}:{r:.3f}" for v, r in best.items())
        print(m, k, n, f"cublas {row['cublas']:.4f}", ratios, flush=True)
        out["rows"].append(row)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
